"""Tools around the runtime: process supervision, the local stack, a blocking decision client.

Nothing in the runtime package imports from here."""
