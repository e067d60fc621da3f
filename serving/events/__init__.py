"""The live event path: the ad server reports impressions, clicks and conversions as they happen; each is made
durable (``log``), merged into the user's online recent-events list (``writer``) and exported exactly once into the
raw event log the daily ingest reads (``export``). ``app`` is the HTTP service (``gemflow events serve``)."""
