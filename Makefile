# Convenience targets; each is one script, which is what CI and the README name.
.PHONY: test test-engines engines

test:
	bash scripts/test.sh

# The real engine tier (vLLM on the CPU, SmolLM2-135M): install if needed, then tests/engines.
test-engines:
	bash scripts/test_engines.sh

# Only install the engines and the model into .engines/.
engines:
	bash scripts/engines/install.sh
