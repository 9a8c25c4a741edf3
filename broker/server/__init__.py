"""The broker process: its loop, handlers, sessions, peers, configuration, start and stop."""
