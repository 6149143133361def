"""`kvsieve bench chaos`: stores and loads against real sidecars while servers, clients, disks
and the shared Redis misbehave; every answer checked against the KV that was stored."""
