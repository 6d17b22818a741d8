"""The environment service: multi-turn environments and tools behind `EnvironmentService` (gRPC).

`base.Environment` is the in-process form (a class with `reset` and `step`); `tool_env.ToolEnvironment`
the built-in tool-using environment; `sessions.SessionTable` runs environments per session with
deadlines and limits; `server.py` is the gRPC adapter and `client.py` the async client."""
