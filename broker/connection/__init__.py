"""The client-side engine: one connection per process per broker, its requests, waiting, liveness and I/O thread."""
