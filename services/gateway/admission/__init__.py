"""Who may send what: API keys and their store, the auth gate, failure throttling, operator auth, rate limits."""
