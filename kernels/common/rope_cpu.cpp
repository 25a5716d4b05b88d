#include <cmath>

#include "kernels/common/rope.h"
#include "kernels/common/rope_math.h"

namespace kvs::kernels {

void rope_cpu(float* x, int num_tokens, int num_heads, int head_dim, const int32_t* positions,
              const float* inv_freq, bool inverse) {
  const int half = head_dim / 2;
  for (int t = 0; t < num_tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = float(positions[t]) * inv_freq[i];
      float s, c;
      rope_sincos(angle, s, c);
      if (inverse) s = -s;
      for (int h = 0; h < num_heads; ++h) {
        float* row = x + (int64_t(t) * num_heads + h) * head_dim;
        const float a = row[i], b = row[i + half];
        row[i] = a * c - b * s;
        row[i + half] = b * c + a * s;
      }
    }
  }
}

}  // namespace kvs::kernels
