"""The gateway: the public OpenAI/DeepSeek-compatible API in front of the engines.

Request path, one file per step:
  tenants             API key -> tenant, its secret salt; key_limits: its concurrency and tokens per minute
  openai_requests     body -> frozen request dataclass (errors: openai_errors); prompt_bound refuses a
                      text that cannot fit the context before it is tokenized
  chat_template       messages -> token ids (tokenizer, token_cache: per tenant)
  engine_router       block hashes + prefix_lookup + least-loaded engine (engine_pool: one engine
                      per address each --engine name resolves to, engine_discovery; engine_client),
                      retried until the first token
  answer_stream       engine tokens -> text deltas (detokenizer, stop_strings)
  completions_endpoint  JSON or SSE in the OpenAI wire format (openai_responses)
app wires the routes; config is the one GatewayConfig; openapi_document is /openapi.json.
"""
