"""SGLang's `sglang.lang.api` import path (`from sglang.lang.api import set_default_backend, gen`):
the same names, from stemma.lang, so such imports port by their package name alone."""
from stemma.lang import (assistant, assistant_begin, assistant_end, function, gen, gen_int, gen_string,
                         image, select, set_default_backend, system, system_begin, system_end, user,
                         user_begin, user_end, video)

__all__ = ["assistant", "assistant_begin", "assistant_end", "function", "gen", "gen_int", "gen_string",
           "image", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
           "user_begin", "user_end", "video"]
