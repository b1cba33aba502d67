"""ferry's common code: the wire messages, typed configuration, transport helpers."""
