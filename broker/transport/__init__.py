"""Bytes on sockets, both ends: the client's transport seam, the direct link and CURVE."""
