"""OpenAI's request and response shapes as the worker reads and writes them: completions, chat, the Responses API, tools, reasoning."""
