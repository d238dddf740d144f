"""lorafleet.worker."""
