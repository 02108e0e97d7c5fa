"""The gRPC service: the Generation servicer and its frames, auth, health, reflection, the
interceptor's error mapping, the admin/client used by the CLI, and chat prompts for gRPC."""
