"""The data port's HTTP/1.1 server: listening and the drain (``listener``), reading requests
(``connection``), answering them in turn (``turns``), a request and its head checks
(``request``), one timer per connection (``clock``) and the request target (``target``)."""
