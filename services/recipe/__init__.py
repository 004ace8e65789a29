"""recipe: the OpenAI-compatible HTTP front (chat completions) over the entrypoint's token API."""
