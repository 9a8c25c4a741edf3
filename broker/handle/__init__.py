"""What a user holds: the ``Channel`` factory and every kind of channel handle."""
