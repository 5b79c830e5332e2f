"""warmfleet server: engine, API, router, multimodal and models; import `warmfleet.server`."""

import warnings

# Paddle warns at import, in every process, that it has no ccache for compiling C++ extensions;
# warmfleet compiles none, and the line would be the first thing every replica log shows.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
