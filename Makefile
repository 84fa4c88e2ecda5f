# Shortcuts; run.sh does the work (it makes ./.venv on first use).
DURATION ?= 600

.PHONY: demo test lint bench soak
demo:
	bash run.sh demo
test:
	bash run.sh test
lint:
	bash run.sh lint
bench:
	bash run.sh bench
soak:
	bash run.sh soak $(DURATION)
