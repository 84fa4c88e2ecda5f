"""The HTTP front: OpenAI-shaped routes, their schemas and replies, the server, the guard
against web pages, and errors as each API spells them."""
