"""``pagedd serve``: settings, the app that runs the gRPC and HTTP servers and the metrics port on
one engine client, and systemd readiness notification."""
