"""Test doubles shipped with pi-env: loopback stand-ins for the remote sandbox services
(`fake_hf_sandbox`, `fake_e2b`) and a small real tokenizer built offline (`tiny_tokenizer`).
The scripted OpenAI-compatible server is product code (the oracle endpoint runs on it): it lives
in `pi_env.scripted`."""
