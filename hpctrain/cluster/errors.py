"""The two ways the emulated cluster can say no."""

from __future__ import annotations

from ..errors import HpctrainError


class ClusterError(HpctrainError):
    """A request the emulation refuses (bad link name, address range taken, in use)."""


class ClusterUnavailable(ClusterError):
    """Namespaces cannot be made here at all (not root, no `ip`): tests skip on this."""
