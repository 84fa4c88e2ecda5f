"""Memory safety, the supervisor's half: monitor, estimator, admission, death classes."""
