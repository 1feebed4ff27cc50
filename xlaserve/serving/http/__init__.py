"""The OpenAI-compatible HTTP front end (Quart app, served by hypercorn)."""
