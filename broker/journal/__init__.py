"""The journal of a durable channel: segment files of checksummed records in a directory, written
by the broker at the points where its queue core changes state (``core/statelog.py``), and read
back when a broker starts on an existing journal (``docs/durability.md``)."""
