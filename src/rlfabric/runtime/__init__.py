"""How every service runs: gRPC server and client, errors, telemetry, metrics, logs, configuration,
credentials, the process guard, path confinement and hardware detection.
"""
