"""recipe: the OpenAI (Chat Completions, Responses) and Anthropic (Messages) HTTP front over the entrypoint's token API."""
