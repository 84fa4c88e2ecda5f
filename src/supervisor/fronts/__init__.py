"""The ways in: the control socket, the HTTP front and its APIs."""
