"""Rollouts on vLLM servers of their own: `rlft serve` (serve.py) starts one, `rollout.servers`
points a run at them (engine.py samples and pushes weights, client.py talks to one and checks it),
guard.py keys every route, transfer.py is the gloo weight transfer engine vLLM loads as a plugin.
Nothing here is imported unless a run or a command uses servers."""
