"""The ModelPool capability: what a backend's instances will need before they need it.

forecast.py  a route's request-rate history and its seasonal forecast (Holt-Winters)
stage.py     counts a prewarm route's requests; exports the forecast and desired endpoints
"""
