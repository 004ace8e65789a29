"""recipe: OpenAI (Chat Completions, Responses) and Anthropic (Messages) over HTTP,
in front of the entrypoint's token API."""
