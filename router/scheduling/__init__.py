"""Router scheduling: Filter → Scorer → Picker, pure and shared by the gateway and the fleet simulator."""
