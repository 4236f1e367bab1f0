"""The live router (``python -m testbed.route``): the simulator's routing policies in front of N
OpenAI-compatible servers (docs/design.md §3 "Routing live").

- `settings`: the ``route`` block and the groups it reads, checked;
- `prompts`: the tokens a request is routed on;
- `replicas`: each replica's state, load and health watch (rotation);
- `proxy`: one request routed, streamed through, retried where nothing was streamed yet;
- `events_feed`: ``router=kv_events``'s index kept in step with each replica's cache events;
- `app`: the router's own endpoints;
- `launch`: local replicas, the router served (`route_forever`) or started for tests
  (`start_router`).
"""
