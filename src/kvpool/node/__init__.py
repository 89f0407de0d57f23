"""One KV cache per node: a daemon (`kvpool serve`) owns one manager and serves every engine on
the node over a Unix socket (`daemon`, `protocol`); an engine's connector talks to it through
`client.NodeClient` or keeps a manager of its own (`store.LocalStore`), behind one interface
(`store.Store`)."""
