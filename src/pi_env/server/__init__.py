"""The deployed form of pi-env: an OpenEnv server (`pi-env serve`) with the MCP tool
`run_rollout`, a web UI at /web, and the typed client `PiEnv` (`pi_env.server.client`).

Needs the `server` extra (`pip install 'pi-env[server]'`). Nothing here is imported by
`import pi_env`; openenv (with gradio) takes seconds to import, so only `app.py` and `web.py`
import it, and `client.py` needs only the `mcp` SDK.
"""
