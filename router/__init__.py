"""lorafleet.router."""
