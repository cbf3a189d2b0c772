"""The endpoints: each route's handler, from a checked request to its JSON or SSE answer, and what they share (``base``)."""
