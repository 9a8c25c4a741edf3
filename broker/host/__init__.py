"""This host's files: the run directory, channel paths and the TOML reader."""
