"""pi-env's helpers for verify checks: mounted read-only beside the start-up (filled in next)."""
