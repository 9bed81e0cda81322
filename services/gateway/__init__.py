"""The gateway: the public OpenAI/DeepSeek-compatible API in front of the engines.

Request path, one file per step:
  tenants             API key -> tenant, its secret salt; key_limits: its concurrency and tokens per minute
  openai_requests     body -> frozen request dataclass (errors: openai_errors); prompt_bound refuses a
                      text that cannot fit the context before it is tokenized; structured_output:
                      tools, tool_choice, response_format -> the engine's grammar
  chat_template       messages (tools, tool results, thinking, prefix; FIM) -> token ids (tokenizer,
                      token_cache: per tenant)
  engine_router       block hashes + prefix_lookup + least-loaded engine (engine_pool: one engine
                      per address each --engine name resolves to, engine_discovery; engine_client),
                      retried until the first token
  answer_stream       engine tokens -> deltas with logprobs; reply_parser splits reasoning, content
                      (detokenizer, stop_strings) and tool calls
  completions_endpoint  JSON or SSE in the OpenAI wire format (openai_responses)
app wires the routes; config is the one GatewayConfig; openapi_document is /openapi.json.
"""
