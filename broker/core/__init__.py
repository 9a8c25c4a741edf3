"""The queue semantics of one channel, free of any transport."""
