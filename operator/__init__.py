"""lorafleet.operator."""
