/* Links against the installed library and makes one call through the C API. */
#include <stdio.h>

#include "residency/residency.h"

int main(void) {
  residency_config* cfg = residency_config_default();
  int ok = cfg != NULL && residency_config_set(cfg, "keep_alive", "5m") == RESIDENCY_OK;
  residency_config_free(cfg);
  printf("consumer: %s\n", ok ? "ok" : residency_last_error());
  return ok ? 0 : 1;
}
