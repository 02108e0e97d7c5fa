"""What the gRPC and HTTP servers share: request limits and validation, and the metrics registry."""
