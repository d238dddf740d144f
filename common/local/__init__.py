"""`lorafleet up`: a whole fleet on this machine (run directory, worker processes, router, placement loop, manifests)."""
