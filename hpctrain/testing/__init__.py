"""Support for hpctrain's own tests. Nothing here runs unless a test switches it on."""
