"""The OpenAI-compatible HTTP server.

engine_loop  the one thread that owns the Engine; handlers talk to it through queues
loop_messages  what crosses its threads: inbox commands, mailboxes, output routing, a request's stream
app          create_app(engine_loop, ...): routes, error handlers, guards
generate     /v1/completions and /v1/chat/completions, whole or streamed (SSE)
serving      the routes' ServingContext and one request's Generation
schemas      strict request bodies and their SamplingParams
serve        `atlas serve`, and serve_in_thread for tests and benchmarks
bench        `atlas bench serve`, the load generator
"""
