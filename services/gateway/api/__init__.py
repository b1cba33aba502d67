"""The HTTP API and the request path: the app, the OpenAI routes and schema, checks, generation, rendering."""
