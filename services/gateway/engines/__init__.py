"""The engines behind the gateway: one client per engine, the pool, routing, discovery, resumption."""
