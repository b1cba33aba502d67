"""What the gateway shows: its Prometheus metrics, the live window, the dashboard and its static files."""
