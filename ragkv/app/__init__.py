"""The application layer: composes the engine with the chunk store, ingestion and sessions
(query pipeline, chat turns, runtime wiring). The CLI, benchmarks and API sit on top."""
