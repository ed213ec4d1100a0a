"""An OpenAI-compatible endpoint on the rollout engine (`ebpo serve`) and the agent gateway of agent RL.

    driver.py   `EngineDriver`: one thread owning the engines; callers submit sequences from any thread
    schema.py   request validation (`parse_request`) and the OpenAI error shape (`RequestError`)
    render.py   chat messages <-> token ids in the training layout; model text -> assistant message, tool calls
    service.py  `ChatService`: a request -> sequences -> a chat completion (n, seed, stop, usage, token ids)
    app.py      the FastAPI app (`create_app`)
    cli.py      `ebpo serve`
    gateway.py  agent RL: one OpenAI client per episode, token-exact episode histories (`run_agent_episodes`)

docs/rl.md ("Serving" and "Agent functions") describes both.
"""
