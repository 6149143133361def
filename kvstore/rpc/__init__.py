"""What the sidecar's client and server share: message conversions, status codes, channels, shm arenas.

Neither side's package imports the other's; both import this one (and the generated stubs).
"""
