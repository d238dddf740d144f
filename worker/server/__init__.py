"""The worker's HTTP server: FastAPI app, public and admin routes, auth, metrics, settings and the `lorafleet worker` command."""
